"""REST: drafts from a datastore over a whole corpus (`drafter.py`), a suffix array over its tokens
(`datastore.py`, `suffix_array.py`), saved and verified as `datastore_format.py` says."""

from .datastore import Datastore, DatastoreError
from .drafter import RESTDrafter

__all__ = ["Datastore", "DatastoreError", "RESTDrafter"]
