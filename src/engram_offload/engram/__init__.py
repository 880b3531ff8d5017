"""The Engram model's own math, exact: the layout (``config``), tokenizer compression
(``tokenizer``), n-gram hashing (``hashing``, C kernel ``_hashkernel.c``), row formats and
their decode (``rows``, C helper ``_rowdecode.c``), the layer (``layer``) and the released
checkpoint's names (``checkpoint``).

Nothing here knows where rows are stored or how they are served: it imports only the
package's shared facts and ``buffers``.
"""
