"""What one llama-server holds in its slots and host-RAM prompt cache, and where a request
would land there (the server's own rules, mirrored)."""
