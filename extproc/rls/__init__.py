"""A drop-in for envoyproxy/ratelimit: its config format (parsed by :mod:`extproc.rls.parse`,
read from files by :mod:`extproc.rls.load`, compiled into :mod:`extproc.rls.config`'s trees), its
matching and answers (:mod:`extproc.rls.match`, sans-IO) and the RLS v3 gRPC service
(:mod:`extproc.rls.service`), on the same Redis counters as the token quotas (docs/rls.md)."""
