"""Project tools: code generation, tokenizer and model training (not installed)."""
