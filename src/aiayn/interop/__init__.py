"""Other toolkits' Transformers in and out of aiayn: MarianMT (OPUS-MT) import and export, CTranslate2
export.

`marian` and `marian_export` need nothing beyond aiayn's own dependencies (they read and write the files
themselves); `ct2` needs the `ctranslate2` package (`pip install aiayn[interop]`).
"""
