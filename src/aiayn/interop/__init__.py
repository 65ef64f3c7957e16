"""Other toolkits' Transformers in and out of aiayn: MarianMT (OPUS-MT) import, CTranslate2 export.

`marian` needs nothing beyond aiayn's own dependencies (it reads the files itself); `ct2` needs the
`ctranslate2` package (`pip install aiayn[interop]`).
"""
