"""The options several `blockdraft` commands share, and the small helpers behind them (`cli.py` holds the commands).

`--set section.key=value` is on every command that reads the config (all but `demo`); a command's own flags
(`--workers`, `--endpoint-url`, ...) are spellings of it: they go into the same overrides `load_config` lays over the
file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from blockdraft.config import StoreConfig, is_s3_url, load_config
from blockdraft.errors import ConfigError

ConfigOpt = Annotated[str | None, typer.Option("--config", "-c", help="blockdraft TOML config file.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", metavar="SECTION.KEY=VALUE", help="Override one config value (repeatable), e.g. --set "
                                                            "train.max_steps=100; lists as a,b or [1, 5], none for "
                                                            "unset. Pinned with the rest of the config."),
]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Take over the output's lease from a writer on another host that is dead but "
                                       "whose lease has not expired yet (never from a process alive on this host).")
]
DeepOpt = Annotated[
    bool, typer.Option("--deep", help="Read every byte back from a remote store and recompute its checksum, instead of "
                                      "trusting the checksum its server stored.")
]
EndpointOpt = Annotated[
    str | None, typer.Option("--endpoint-url", help="S3 endpoint (beats store.endpoint_url, AWS_ENDPOINT_URL_S3, "
                                                    "AWS_ENDPOINT_URL).")
]
ConcurrencyOpt = Annotated[int | None, typer.Option("--concurrency", min=1, help="Parts in flight (memory ~ part size "
                                                                                 "x this).")]
PartSizeOpt = Annotated[int | None, typer.Option("--part-size-mib", min=5, help="Multipart part size in MiB.")]


def store_config(
    config: str | None, sets: list[str] | None, endpoint_url: str | None, concurrency: int | None = None,
    part_size_mib: int | None = None,
) -> StoreConfig:
    """The [store] section for a store command: the file's, with `--endpoint-url`, `--concurrency`, `--part-size-mib`
    and `--set` laid over it."""
    flags = {"endpoint_url": endpoint_url, "concurrency": concurrency, "part_size_mib": part_size_mib}
    return load_config(config, {"store": flags}, sets or ()).store


def in_store(location: str, settings: StoreConfig) -> str:
    """A push destination or pull source as given, or, when it is a bare relative name (`tokenized`,
    `runs/try-2/export`: no scheme, not absolute, not starting with `.` or `~`) and store.url is on S3, that name under
    store.url."""
    bare = "://" not in location and not location.startswith(("/", ".", "~"))
    if bare and is_s3_url(settings.url):
        return f"{settings.url.rstrip('/')}/{location}"
    return location


def progress_page(progress: str) -> Path:
    """The `--progress` page's path, refused at once (one line) when its folder is missing or it names a folder."""
    page = Path(progress)
    if not page.parent.is_dir():
        raise ConfigError(f"--progress {progress}: the folder {page.parent} does not exist; create it or write the "
                          "page elsewhere")
    if page.is_dir():
        raise ConfigError(f"--progress {progress} is a folder; name the page's file, e.g. {page / 'PROGRESS.md'}")
    return page


def write_page(page: Path, text: str) -> None:
    try:
        page.write_text(text)
    except OSError as exc:  # a read-only folder, a full disk
        raise ConfigError(
            f"cannot write the --progress page {page} ({exc.strerror}); write it to another folder"
        ) from None
