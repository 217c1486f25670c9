"""The ``store=`` argument an engine takes (`check_store_arg`, `open_store`): a `PrefixStore`, or a store URL with
the model's id. One rule for every integration that accepts a store (Tunix's rollout engine, EasyDeL's eSurge).
"""

from __future__ import annotations

from easykv.tiers.store.prefix_store import PrefixStore
from easykv.tiers.store.url import parse_store_url


def check_store_arg(store: object, model_id: object) -> None:
    """TypeError / ValueError, before the engine makes anything, unless ``store`` is None, a `PrefixStore` or a
    store URL, with ``model_id`` given exactly with a URL (a `PrefixStore` carries its own).

    Args:
      store: the engine's ``store=``.
      model_id: the engine's ``model_id=``."""
    if store is None:
        if model_id is not None:
            raise ValueError(f"model_id={model_id!r} was given without a store; it names the model in a shared prefix "
                             "store: pass store='file:///dir' (or another store URL) with it, or leave it out")
        return
    if isinstance(store, PrefixStore):
        if model_id is not None:
            raise ValueError(f"model_id={model_id!r} was given with a PrefixStore, which carries its own "
                             f"(model_id={store.model_id!r}); leave model_id out, or pass the store's URL instead")
        return
    if not isinstance(store, str):
        raise TypeError(f"store must be a store URL (str, e.g. 'file:///dir' or 'redis://host:6379/0'), an "
                        f"easykv.tiers.store.PrefixStore or None, got {type(store).__name__}")
    parse_store_url(store)  # ValueError naming the URL and the fix
    if model_id is None:
        raise ValueError(f"store={store!r} needs model_id=: the name and revision of the model (e.g. "
                         "'Qwen/Qwen3-0.6B@main'), the same in every engine that may share its pages; easykv never "
                         "guesses it (the weights' own changes are told apart by the engine)")


def open_store(store: str | PrefixStore, model_id: str | None) -> tuple[PrefixStore, bool]:
    """The engine's `PrefixStore` and whether the engine opened it (then it closes it too).

    Args:
      store: a URL or a `PrefixStore` (`check_store_arg` passed).
      model_id: with a URL, the model's id."""
    if isinstance(store, PrefixStore):
        return store, False
    return PrefixStore(store, model_id=model_id), True  # type: ignore[arg-type]  # checked: a str with a URL


__all__ = ["check_store_arg", "open_store"]
