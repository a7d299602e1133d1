"""One module per client-facing API format (chat, completions, responses, messages, embeddings).

Each exposes an :class:`~extproc.core.apis.base.ApiFormat`; :mod:`extproc.core.apis.registry`
picks one from the request path.  Pure: no grpc or redis imports.
"""
