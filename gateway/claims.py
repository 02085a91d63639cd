"""A request holds four claims: a slot in its tenant's limits, an admission ticket (what the
TTFT prediction counts as queued), its place in the retry budget (gateway/retry_budget.py)
and its cost on its decode worker (what routing balances on). `Claims` takes them in that
order and `release()` gives back whatever is held, once, on every path: a refusal, a failed start, the end of the answer, an error mid-stream, or a
client that left at any moment (the response releases them when it ends, whether or not
its body was ever read).
"""

from __future__ import annotations

from gateway.admission import Admission, Ticket
from gateway.errors import APIError
from gateway.retry_budget import RetryBudget
from gateway.routing.router import WorkerState
from gateway.tenants import Tenant


class Claims:
    """What one request holds while it is served; `release()` gives it all back, once."""

    def __init__(self, tenant: Tenant, admission: Admission, cost: int, prompt_tokens: int, choices: int = 1,
                 budget: RetryBudget | None = None):
        self.tenant, self.admission, self.cost, self.prompt_tokens = tenant, admission, cost, prompt_tokens
        self.choices = choices  # sequences on the decode worker: each counts against the tenant's limit
        self.budget = budget  # counts it among the requests in flight (None: no budget)
        self.ticket: Ticket | None = None
        self.worker: WorkerState | None = None
        self._tenant_held = self._budget_held = self._released = False

    def take(self, kv_room: bool) -> None:
        """The tenant's slot, then an admission ticket, then its place in the retry budget's
        count; on a refusal (429) nothing is held."""
        self.tenant.admit(self.cost, self.choices)
        self._tenant_held = True
        try:
            self.ticket = self.admission.admit(self.prompt_tokens, kv_room=kv_room)
        except APIError:
            self.release()
            raise
        if self.budget is not None:
            self.budget.started()
            self._budget_held = True


    def on(self, worker: WorkerState) -> None:
        """The request now counts on `worker` (its cost, and its prompt's KV until it ends)."""
        self.worker = worker
        worker.outstanding_tokens += self.cost
        worker.kv_claimed_tokens += self.prompt_tokens

    def off(self, freed: bool = True) -> None:
        """... and no longer: its start there failed, it moved to another worker, or it ended
        (`freed`: its blocks there are free now, not only once the worker takes an abort)."""
        w, self.worker = self.worker, None
        if w is not None:
            w.outstanding_tokens -= self.cost
            w.end_claim(self.prompt_tokens, freed)

    def first_token(self) -> None:
        if self.ticket is not None:
            self.admission.first_token(self.ticket)

    def release(self, freed: bool = False) -> None:
        """Everything given back, once; `freed`: every choice ended on its worker (its last
        message came), so its KV is room at once."""
        if self._released:
            return
        self._released = True
        self.off(freed)
        if self._tenant_held:
            self.tenant.release(self.cost, self.choices)
        if self._budget_held:
            self.budget.ended()
        if self.ticket is not None:
            self.admission.first_token(self.ticket, served=False)  # a no-op once it was served
