"""TLS on the gateway's client port (`--ssl-certfile` / `--ssl-keyfile`, uvicorn's names).

With both set, every gateway process serves its client socket over TLS alone: a plain HTTP
request there fails the handshake and is closed. The admin socket (loopback only, the
deploy controller's membership pushes, its own token: gateway/front_door/admin_listener.py) stays
plain, so uvicorn's one-context-for-every-socket is not used as is: `Server` starts the
client sockets with the context and the admin socket without.

The certificate and key are loaded at start, so a wrong path, a key that does not match the
certificate or a file that is not PEM is an error naming it before anything listens.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

import uvicorn


def check_files(certfile: str | None, keyfile: str | None) -> str | None:
    """Why these cannot serve TLS (None: they can, or TLS is off)."""
    if not certfile and not keyfile:
        return None
    if not certfile:
        return "--ssl-keyfile needs --ssl-certfile (the certificate chain, PEM)"
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        return f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: cannot load them: {e}"
    return None


class Server(uvicorn.Server):
    """uvicorn's server over `sockets` (TLS when the config has it) plus `plain` sockets
    served without TLS by the same app and state."""

    def __init__(self, config: uvicorn.Config, plain: list[socket.socket]):
        super().__init__(config)
        self.plain = plain

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit:
            return
        loop = asyncio.get_running_loop()
        config = self.config

        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(config=config, server_state=self.server_state,
                                              app_state=self.lifespan.state)

        for sock in self.plain:
            self.servers.append(await loop.create_server(protocol, sock=sock, ssl=None, backlog=config.backlog))
