"""The engine's step loop: requests, sequences, scheduler, KV cache manager, model
runner, sampling and decode graphs. Imports `model/`, never `serve/`."""
