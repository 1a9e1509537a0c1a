"""The PrfaaS services: router, prefill and decode workers, cache directory, model, policies."""
