"""The gateway's Redis store, split by what it stores: personas (:mod:`.personas`), quota places
(:mod:`.quotas`), sessions and their messages (:mod:`.sessions`), turns and their locks (:mod:`.turns`),
reply streams (:mod:`.streams`), and which gateway processes are alive (:mod:`.liveness`). :mod:`.keys` names every key.

:class:`Store` is all of them over one connection: the object the gateway passes around.
"""

from __future__ import annotations

from chatsvc.store.keys import P, session_key
from chatsvc.store.personas import PersonaStore
from chatsvc.store.quotas import QuotaPlace, QuotaStore
from chatsvc.store.sessions import SessionMeta, SessionStore
from chatsvc.store.streams import EventWriter, StreamStore
from chatsvc.store.turns import SessionGone, TurnStore

__all__ = ["EventWriter", "P", "QuotaPlace", "SessionGone", "SessionMeta", "Store", "session_key"]


class Store(TurnStore, SessionStore, StreamStore, PersonaStore, QuotaStore):
    """Every part of the store on one Redis connection, with one identity (instance name and nonce)."""
