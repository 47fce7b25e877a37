"""Converters: raw datasets -> packed files, done once."""

from fastdata.converters.imagefolder import convert_imagefolder, find_images
from fastdata.converters.report import ConversionReport
from fastdata.converters.text import convert_text, find_texts

__all__ = ["ConversionReport", "convert_imagefolder", "convert_text", "find_images", "find_texts"]
