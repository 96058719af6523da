"""The router's HTTP face: the OpenAI API (chat and text completions, models, vLLM's tokenize
and detokenize), the Anthropic Messages API and a health check, served by uvicorn on the router
actor's own event loop. Every generation goes through the same serving core as gRPC
(cluster/router_service.py `RouterService.generate`): one routing and validation path, two faces.
"""
