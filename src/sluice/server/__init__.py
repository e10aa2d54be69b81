"""The HTTP service: the API, its lookup fast paths and its middleware."""
