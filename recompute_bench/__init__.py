"""recompute-bench: measure, predict and gate activation-recomputation settings of GPT training."""


def __getattr__(name: str) -> str:
    # `__version__` is read from the installed metadata when asked for, not at import: the command
    # line's entry point imports this package first, and Ctrl-C there is not yet guarded (cli/__init__).
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import metadata
    try:
        return metadata.version("recompute-bench")
    except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH that was never installed
        return "0+unknown"
