"""What the proxy and the Django apps both speak, with no Django in it: the OpenAI wire format
(SSE framing, stream reassembly), the request rewrites of canary routes and context updates,
the spool's file format, crypto primitives, ids and the engines allow-list. The mitmproxy
process imports only this package and proxy/ (tests/test_layout.py checks it)."""
