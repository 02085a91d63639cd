"""DeepSeek's multi-token-prediction (MTP) layers, loaded for the speculative decoder to run.

A DeepSeek-V3 checkpoint carries `num_nextn_predict_layers` layers past the decoder's
(model.layers.61 in the released one). Each predicts one token further than the one before:
from the previous depth's last hidden state h and the embedding e of the token after it,
`eh_proj([enorm(e); hnorm(h)])` goes through a decoder layer of the model's own kind (MLA
attention, experts) and `shared_head` (a norm, then a head over the vocabulary). Its
`embed_tokens` is the model's embedding (the checkpoint stores a copy, not read). They are
built and loaded only when asked (`EngineConfig.load_mtp`): the decoder never runs them.
"""

from __future__ import annotations

from torch import nn

from engine.config import ModelConfig


class SharedHead(nn.Module):
    """The MTP layer's final norm and its head (one rank's vocabulary rows under tensor parallelism)."""

    def __init__(self, cfg: ModelConfig, linear: type[nn.Linear], norm: type[nn.Module]):
        super().__init__()
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class MtpLayer(nn.Module):
    """One multi-token-prediction depth: its two input norms and projection, its decoder
    `layer` (built by the caller: the model's own layer kind at index num_layers + depth),
    and its shared head."""

    def __init__(self, cfg: ModelConfig, layer: nn.Module, linear: type[nn.Linear], norm: type[nn.Module]):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = norm(h, cfg.rms_norm_eps)  # the next token's embedding
        self.hnorm = norm(h, cfg.rms_norm_eps)  # the previous depth's hidden state
        self.eh_proj = linear(2 * h, h, bias=False)
        self.layer = layer
        self.shared_head = SharedHead(cfg, linear, norm)


# checkpoint modules of an MTP layer that are its own (the rest are its decoder layer's)
OWN_MODULES = ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")
SKIPPED = ("embed_tokens.weight",)  # the model's embedding, stored again with each depth
