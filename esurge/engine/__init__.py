"""The engine: the core busy loop, the eSurge Python API and detokenization."""
