"""Converters: raw datasets -> packed files, done once."""

from fastdata.converters.imagefolder import convert_imagefolder, find_images
from fastdata.converters.report import ConversionReport

__all__ = ["ConversionReport", "convert_imagefolder", "find_images"]
