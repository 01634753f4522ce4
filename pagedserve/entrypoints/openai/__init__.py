"""The OpenAI-compatible HTTP server: protocol (wire models), serving (requests -> engine ->
responses), api_server (routes, gate, uvicorn runner), errors."""
