"""The HTTP side of a request: endpoints, typed app keys, admission, validation of
request fields, and the prompt ids computed beside the event loop."""
