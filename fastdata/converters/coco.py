"""COCO-style detection sets (images + one annotations JSON) read as records for fastdata.write.

One record per listed image: ``image``, ``image_id``, ``file_name``,
``boxes`` float32 ``[n, 4]`` (x, y, width, height in the stored image's
pixels), ``category_ids`` int64 ``[n]`` and ``iscrowd`` uint8 ``[n]``; an
image without annotations has ``n = 0``. The category names go into the
file's metadata.

NOTE [boxes follow the image]: images are stored at one size, so each box
is moved exactly as its image is: scaled with ``resize="stretch"``, scaled
and offset into the padded frame with ``resize="pad"`` (the default here),
using the very placement the resize uses (codecs.images.pad_placement).
``resize="crop"`` would cut boxes at the frame's edges, losing annotation,
and is refused. The image's own size (read from its header) is used, not
the JSON's ``width``/``height``, which can disagree with the file.
"""

import json
import os
from collections import defaultdict

import numpy as np
from PIL import Image

from fastdata.codecs.images import ImageSpec, pad_placement
from fastdata.converters.records import write
from fastdata.converters.recordsources import ImageOptions
from fastdata.errors import OptionError, SourceError
from fastdata.formats.records import Field


def read_coco(annotations, images_root=None, image_options=None):
    """Read the COCO ``annotations`` JSON; images are ``file_name`` under ``images_root`` (default: its folder).

    Returns ``(schema, records, described)`` for fastdata.write.

    Raises:
        SourceError: the JSON is not a COCO detection file (images, annotations, categories), or an
            annotation names an image or category the file does not list.
        OptionError: ``resize="crop"`` (see NOTE [boxes follow the image]).
    """
    options = image_options or ImageOptions(resize="pad")
    options.resize = options.resize or "pad"
    if options.resize == "crop":
        raise OptionError("resize='crop' would cut boxes off at the edges of the stored image; use 'pad' (the "
                          "default for detection) or 'stretch'")
    annotations = os.fspath(annotations)
    images, boxes_of, categories = _parse(annotations)
    root = os.fspath(images_root) if images_root is not None else os.path.dirname(os.path.abspath(annotations))
    schema = {"image": options.field(), "image_id": "int", "file_name": "str",
              "boxes": Field("ragged", dtype="float32", shape=(4,), boxes="image"),
              "category_ids": Field("ragged", dtype="int64"),
              "iscrowd": Field("ragged", dtype="uint8")}
    spec = ImageSpec(*options.size, resize=options.resize)

    def records():
        for image in images:
            path = os.path.join(root, image["file_name"])
            found = boxes_of.get(image["id"], [])
            yield {"image": path, "image_id": image["id"], "file_name": image["file_name"],
                   "boxes": _placed(np.array([box for box, _, _ in found], np.float64).reshape(-1, 4), path, spec),
                   "category_ids": [category for _, category, _ in found],
                   "iscrowd": [crowd for _, _, crowd in found]}

    return schema, records(), {"coco": os.path.basename(annotations), "categories": categories}


def _parse(path):
    """Return ``(images, {image id: [(box, category id, iscrowd)]}, {category id: name})`` of a COCO JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        images, annotations = data["images"], data.get("annotations", [])
        categories = {int(item["id"]): str(item["name"]) for item in data.get("categories", [])}
        listed = {image["id"] for image in images}
        for image in images:
            if not isinstance(image.get("file_name"), str):
                raise KeyError(f"image {image.get('id')!r} has no file_name")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SourceError(f"{path!r} is not a COCO detection file (images with file_name, annotations, "
                          f"categories): {exc!r}") from exc
    boxes_of = defaultdict(list)
    for number, item in enumerate(annotations):
        if item.get("image_id") not in listed or int(item.get("category_id", -1)) not in categories:
            raise SourceError(f"{path!r}: annotation {number} names image {item.get('image_id')!r} and category "
                              f"{item.get('category_id')!r}, and the file lists no such "
                              f"{'image' if item.get('image_id') not in listed else 'category'}")
        bbox = item.get("bbox")
        if not isinstance(bbox, list) or len(bbox) != 4 or not all(isinstance(v, (int, float)) for v in bbox):
            raise SourceError(f"{path!r}: annotation {number} has bbox {bbox!r}, not [x, y, width, height]")
        boxes_of[item["image_id"]].append((bbox, int(item["category_id"]), int(bool(item.get("iscrowd", 0)))))
    return images, boxes_of, categories


def _placed(boxes, path, spec):
    """Return ``boxes`` ``[n, 4]`` (x, y, w, h) of the image at ``path`` moved into the stored image (float32).

    An image whose size cannot be read gets its boxes as they are: its image will not decode either, and
    the writer names the record.
    """
    try:
        with Image.open(path) as image:
            width, height = image.size
    except (OSError, ValueError):
        return boxes.astype(np.float32)
    if spec.resize == "stretch":
        left, top, inner_w, inner_h = 0, 0, spec.width, spec.height
    else:
        left, top, inner_w, inner_h = pad_placement(width, height, spec)
    scale = np.array([inner_w / width, inner_h / height, inner_w / width, inner_h / height])
    return (boxes * scale + np.array([left, top, 0, 0])).astype(np.float32)


def convert_coco(annotations, out, *, images=None, size=64, storage="raw", quality=None, resize="pad", mode=None,
                 **options):
    """Convert a COCO-style detection set into the record file ``out`` (see read_coco).

    ``images``: the folder of its images (default: the annotations' folder). ``options``: fastdata.write's.
    """
    schema, records, described = read_coco(annotations, images, ImageOptions(size, storage, quality, resize, mode))
    return write(records, out, schema, source=described, **options)
