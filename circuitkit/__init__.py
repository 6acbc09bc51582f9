"""CircuitKit: circuit discovery (EAP, EAP-IG) and head pruning on Hugging Face causal LMs."""

__version__ = "0.1.0"
