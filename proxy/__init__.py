"""kvroute: prefix-cache-aware routing in front of llama-server."""
