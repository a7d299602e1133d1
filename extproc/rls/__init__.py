"""A drop-in for envoyproxy/ratelimit: its config format (:mod:`extproc.rls.config`), its
matching and answers (:mod:`extproc.rls.match`, sans-IO) and the RLS v3 gRPC service
(:mod:`extproc.rls.service`), on the same Redis counters as the token quotas (docs/rls.md)."""
