"""One sample <-> bytes or token ids, without torch: images (Pillow, simplejpeg) and tokenizers."""
