"""What ``ai-quota serve`` runs of the admin side: the store subscription (every replica) and
the admin gRPC server (when ``--admin-port`` is set)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from extproc.admin.auth import TokenFile
from extproc.admin.rules import Effective, read_file_rules
from extproc.admin.server import AdminServer, start_admin_server
from extproc.admin.service import AdminServicer
from extproc.admin.store import AdminStore
from extproc.admin.sync import StoreSync
from extproc.config.runtime import RuntimeConfig
from extproc.settings import Settings

if TYPE_CHECKING:
    from extproc.metrics import Metrics

log = structlog.get_logger("extproc.admin")


@dataclass
class AdminRuntime:
    """The store, the subscription to it and the optional admin server of one process."""

    store: AdminStore
    sync: StoreSync
    server: AdminServer | None = None

    def reload_file(self, path: str) -> tuple[RuntimeConfig, str]:
        """SIGHUP: the rules file read again with the store merged in, and its version."""
        eff = self.sync.reload_file(path)
        return eff.config, eff.version

    async def close(self) -> None:
        """Stop serving and following the store."""
        if self.server is not None:
            await self.server.stop()
        await self.sync.stop()
        await self.store.close()


async def start_admin(
    settings: Settings,
    apply: Callable[[Effective], None],
    *,
    version_of: Callable[[str], str],
    metrics: Metrics | None = None,
) -> AdminRuntime:
    """Follow the admin store (``apply`` swaps each effective config in) and, with an admin
    port, serve the admin API.  Raises ``AdminConfigError`` for unsafe admin settings."""
    token = TokenFile(settings.admin_token_file) if settings.admin_token_file else None
    store = AdminStore.from_url(settings.redis_url, prefix=settings.key_prefix)
    rules = read_file_rules(settings.config, version_of)
    sync = StoreSync(store, rules, apply, version_of=version_of, metrics=metrics)
    runtime = AdminRuntime(store, sync)
    if settings.admin_port:
        try:
            runtime.server = await start_admin_server(
                AdminServicer(store, sync, metrics=metrics),
                host=settings.admin_host,
                port=settings.admin_port,
                token=token,
                tls_cert=settings.admin_tls_cert or None,
                tls_key=settings.admin_tls_key or None,
                tls_client_ca=settings.admin_tls_client_ca or None,
                allow_plaintext=settings.admin_allow_plaintext,
                reuse_port=settings.workers > 1 or settings.reuse_port,
            )
        except BaseException:
            await store.close()
            raise
    await sync.start()
    return runtime
