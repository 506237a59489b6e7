"""Token ids and their text: ids checked against the model and padded (``inputs``), and the one display of a
token's text (``display``). Imports nothing of ``interp``'s other rooms.
"""
