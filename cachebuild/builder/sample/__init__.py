"""One source file -> one sample: its header (``probe``), its geometry and recipe (``geometry``), its decode
and resize (``decode``, with the antialiased kernel ``aa_resize``). The block and pipeline modules above run
these per file in the workers."""
