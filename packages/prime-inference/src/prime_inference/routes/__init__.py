"""FastAPI routers: OpenAI routes (`openai`), vLLM's token-in generate (`generate`) and admin routes (`admin`).

Each endpoint is one decorated function that reads the served model from ``request.app.state.prime`` (a
`prime_inference.serving.ServerState`). The torch engine's app includes all three; the vLLM engine's app is
vLLM's own OpenAI app with `generate` and `admin` included in front (`prime_inference.vllm_app`).
"""
