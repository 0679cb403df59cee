"""The HTTP side of a request: endpoints, typed app keys, admission, validation of
request fields, the prompt ids computed beside the event loop, the model pools a request
names, the backends' own metrics on /metrics, the live status page with its event
stream, and the runner that answers requests that do not parse as HTTP."""
