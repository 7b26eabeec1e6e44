"""Ways into tracedac from libraries that checkpoint on their own terms.

``tracedac.integrations.hf``: Hugging Face transformers (and PEFT models built on it).
``tracedac.integrations.torchtitan``: torchtitan's activation checkpointing modes (``enable()``).
Each integration is imported on demand; nothing here imports the library it serves.
"""
