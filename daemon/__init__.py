"""The engine: model loading, the Llama forward pass, sampling, tokenizer and
chat template, and (later) the server loop."""
