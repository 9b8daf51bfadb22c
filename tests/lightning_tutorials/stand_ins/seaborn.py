"""A stand-in for seaborn: the tutorials draw their metrics (``relplot``, ``set``); here nothing is drawn."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return lambda *args, **kwargs: None
