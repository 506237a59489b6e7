"""Where and how things run: device maps and sharding over processes, CPU threads, progress bars, and files written
so that none is half-written or lost. Imports nothing of ``interp``'s other rooms.
"""
