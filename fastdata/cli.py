"""Command line: `fastdata convert | info` (thin wrappers over the library)."""

import functools
import signal
import sys
import traceback

import click

from fastdata.errors import FastdataError


def _reports_errors(command):
    """Print a FastdataError (or bad file/argument) as one line and exit 1."""

    @functools.wraps(command)
    def wrapper(*args, debug=False, **kwargs):
        try:
            return command(*args, **kwargs)
        except (FastdataError, FileNotFoundError, FileExistsError, ValueError) as exc:
            if debug:
                traceback.print_exc()
            raise click.ClickException(str(exc)) from exc

    return click.option("--debug", is_flag=True, help="Show the full traceback on errors.")(wrapper)


@click.group()
@click.version_option(package_name="fastdata")
def main():
    """Pack datasets once, then train from the packed file at memory speed."""
    # A terminated conversion unwinds like Ctrl-C, so its staging files go.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


@main.group()
def convert():
    """Convert a raw dataset into a packed .h5 or .arrow file."""


@convert.command("imagefolder")
@click.argument("src", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--size", default="64", show_default=True, help="Stored size: N (square) or HxW.")
@click.option("--resize", type=click.Choice(["crop", "pad", "stretch"]), default="crop", show_default=True,
              help="crop: cover then center-crop; pad: fit then pad; stretch: ignore aspect ratio.")
@click.option("--resample", type=click.Choice(["bilinear", "bicubic", "lanczos", "nearest"]), default="bilinear",
              show_default=True, help="Resampling filter.")
@click.option("--storage", type=click.Choice(["raw", "jpeg"]), default="raw", show_default=True,
              help="raw: uint8 pixels (fastest to load); jpeg: re-encoded, 5-10x smaller.")
@click.option("--quality", type=click.IntRange(1, 100), default=90, show_default=True,
              help="JPEG quality with --storage jpeg.")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Decoding processes [default: all cores].")
@click.option("--on-error", type=click.Choice(["skip", "warn", "raise"]), default="skip", show_default=True,
              help="What to do with an image that cannot be decoded.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@_reports_errors
def convert_imagefolder_command(src, out, size, resize, resample, storage, quality, workers, on_error, overwrite,
                                quiet):
    """Pack the ImageFolder tree SRC (SRC/<class>/<image>) into OUT (.h5, .hdf5 or .arrow)."""
    from fastdata.converters import convert_imagefolder

    report = convert_imagefolder(
        src, out, size=_parse_size(size), resize=resize, resample=resample, storage=storage, quality=quality,
        workers=workers, on_error=on_error, overwrite=overwrite, progress=not quiet,
    )
    click.echo(str(report))


@main.command()
@click.argument("path", type=click.Path(dir_okay=False))
@_reports_errors
def info(path):
    """Describe the packed file PATH: samples, classes, shape, statistics, skipped inputs."""
    from fastdata.info import describe

    click.echo(describe(path))


def _parse_size(text):
    parts = text.lower().split("x")
    try:
        sizes = [int(part) for part in parts]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2) or min(sizes) < 1:
        raise click.BadParameter(f"expected N or HxW with positive integers, got {text!r}", param_hint="--size")
    return sizes[0] if len(sizes) == 1 else tuple(sizes)
