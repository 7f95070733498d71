"""What the registries of policy losses and advantage estimators treat as the same definition registered again."""

from __future__ import annotations

from collections.abc import Callable


def is_redefinition(registered: Callable | None, new: Callable) -> bool:
    """Whether `new` is `registered`'s definition run again: the same function, or one of the same module and
    qualified name (a notebook cell run a second time, `importlib.reload` of the user's module, a plugin imported by
    `trl-aspo train` and again by the user's own code), which then replaces it. Anything else under a registered
    name is refused."""
    if registered is None:
        return False
    if registered is new:
        return True
    key = (getattr(registered, "__module__", None), getattr(registered, "__qualname__", None))
    return None not in key and key == (getattr(new, "__module__", None), getattr(new, "__qualname__", None))
