"""Optional packages (extras), imported on first use with an install hint."""

import importlib

from fastdata.errors import MissingDependencyError


def require(module, extra, feature):
    """Return ``module`` imported, or raise MissingDependencyError naming the extra.

    Args:
        module: the module to import, e.g. "tokenizers".
        extra: fastdata's extra that installs it, e.g. "tokenizers".
        feature: what needs it, for the message.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{feature} needs the {module!r} package: pip install 'fastdata[{extra}]'"
        ) from exc


def optional(module):
    """Return ``module`` imported, or None where it is not installed (a faster path)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
