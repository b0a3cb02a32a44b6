"""What a Hugging Face script meets of Spotline besides its Trainer (``spotline.hf``): where
its model comes from, and its mistakes reported in one line.

- :func:`pretrained_source`: the ``--model_name_or_path`` a script passes to
  ``from_pretrained``, checked at once: a local ``save_pretrained`` directory, or a hub id
  the hub cache or one request to the hub knows; otherwise one line naming the cause.
- Importing this module installs a ``sys.excepthook`` under which an uncaught
  :class:`~spotline.errors.UserError` is one line ``spotline: error: ...`` and exit 2, under
  plain python as under ``spotline run`` (whose child and workers catch it themselves).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import TracebackType

from spotline.errors import UserError, one_line

# The exit code of a user's mistake, as every Spotline entry point's.
EXIT_USER_ERROR = 2
# The one look-up of a model id on the hub (pretrained_source), in seconds: from_pretrained
# retries an unreachable hub for most of a minute before it says so.
HUB_LOOKUP_TIMEOUT_S = 3.0


def _could_be_hub_id(name: str) -> bool:
    # validate_repo_id is public (documented); the package's lazy __init__ hides it from mypy.
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]

    if os.path.isabs(name) or name.startswith(("./", "../", "~")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def pretrained_source(name: str, *, what: str = "model") -> str:
    """What a script passes to ``from_pretrained`` for the model ``name`` (its
    ``--model_name_or_path``; ``what`` names it in messages): a local ``save_pretrained``
    directory (``~`` expanded), else ``name`` as a hub id the hub cache or the hub has.

    Otherwise a UserError within seconds that names the cause: no such local directory (a
    name only a path can be, or ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` set), or neither
    a local directory nor on the hub after one request to ``HF_ENDPOINT`` of at most
    :data:`HUB_LOOKUP_TIMEOUT_S` (``from_pretrained`` retries for most of a minute and ends
    on a connection error that never names the missing directory)."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    local = Path(os.path.expanduser(name))  # unchanged where ~user is unknown (Path raises)
    fix = "pass a directory that model.save_pretrained() wrote"
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise UserError(f"{what} {name!r}: the directory has no config.json; {fix}")
        return str(local)
    if not _could_be_hub_id(name):
        missing = "not a directory" if local.exists() else "no such local directory"
        raise UserError(f"{what} {name!r}: {missing}; {fix}")
    if isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str):
        return name  # from_pretrained loads the hub cache's copy (offline too)
    if constants.HF_HUB_OFFLINE:
        raise UserError(
            f"{what} {name!r}: no such local directory (HF_HUB_OFFLINE is set and the hub "
            f"cache has no such model); {fix}"
        )
    try:
        huggingface_hub.model_info(name, timeout=HUB_LOOKUP_TIMEOUT_S)
    except GatedRepoError:
        raise UserError(
            f"{what} {name!r} is a gated model on the hub; request access on its page and "
            "log in (hf auth login), or pass a local directory"
        ) from None
    except RepositoryNotFoundError:
        raise UserError(
            f"{what} {name!r} is neither a local directory nor a model on the hub "
            f"({constants.ENDPOINT}) you can access; {fix}, or a hub model id"
        ) from None
    except Exception as exc:
        # Whatever stopped the one request (connection, proxy, TLS, timeout, an HTTP error)
        # means the hub is not reachable from here.
        raise UserError(
            f"{what} {name!r} is neither a local directory nor reachable on the hub "
            f"({constants.ENDPOINT}: {one_line(exc)}); {fix}, or check the network and "
            "HF_ENDPOINT"
        ) from None
    return name


def _exit_on_user_error(
    kind: type[BaseException], value: BaseException, traceback: TracebackType | None
) -> None:
    """``sys.excepthook``: an uncaught UserError (a plain-python script's mistake) is one line
    and exit 2, as ``spotline run`` reports it; anything else goes to the previous hook."""
    if not isinstance(value, UserError):
        _previous_excepthook(kind, value, traceback)
        return
    sys.stdout.flush()
    print(f"spotline: error: {value}", file=sys.stderr, flush=True)
    # A SystemExit raised in the excepthook is the interpreter's exit, with this code (and
    # the usual teardown: atexit handlers run, buffers flushed).
    sys.exit(EXIT_USER_ERROR)


# spotline run's child and workers catch a UserError themselves; this is for plain python.
_previous_excepthook = sys.excepthook
sys.excepthook = _exit_on_user_error
