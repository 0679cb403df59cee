"""The OpenAI Responses API on top of the chat endpoint: request conversion as
llama-server does it, answers and SSE events relayed in the Responses format."""
