"""One module per client-facing API format (chat, completions, responses, messages, embeddings).

Each exposes an :class:`~extproc.core.apis.base.ApiFormat`; :func:`api_for_path` picks it
from the request path.  Pure: no grpc or redis imports.
"""
