"""Request -> the exact token ids llama-server will put in (and cache for) a slot:
the chat request as the server prepares it, its Jinja template, the tokenizer and its
fragment cache (llama.py: its bindings, on the llama-server build's libllama), and the
fill-in-the-middle prompt the server builds for `/infill`."""
