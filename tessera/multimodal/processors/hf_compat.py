"""Calls into transformers' processors that changed shape within the 5.x versions Tessera supports."""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def merge_processor_kwargs(hf_processor: Any, kwargs_class: str, **kwargs: Any) -> dict[str, dict]:
    """hf_processor._merge_kwargs(...): its defaults, the saved settings, then `kwargs`. Transformers < 5.23
    needs the processor's kwargs class ("module:Class") as the first argument; 5.23+ deprecate those
    classes (5.29 removes them) and read the processor's own."""
    module_name, class_name = kwargs_class.split(":")
    cls = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            pass
    init_kwargs = hf_processor.tokenizer.init_kwargs
    if cls is None:
        return hf_processor._merge_kwargs(tokenizer_init_kwargs=init_kwargs, **kwargs)
    return hf_processor._merge_kwargs(cls, tokenizer_init_kwargs=init_kwargs, **kwargs)
