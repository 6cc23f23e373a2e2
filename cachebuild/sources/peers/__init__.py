"""Converters from the peers' formats: FFCV ``.beton`` files, MosaicML Streaming MDS datasets and LitData
``optimize`` output, each a source kind (``cachebuild ffcv``, ``cachebuild mds``, ``cachebuild litdata``) that
plans the samples by byte range from the format's own layout, without importing the peer, so the build decodes
and resizes them as it does any source."""
