"""Tools a user runs beside the library: a load generator for a running server (``load_generator``)
and the paired accuracy difference of two answer files (``paired_accuracy``)."""
