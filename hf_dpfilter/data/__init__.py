"""From the data set to the micro-batches the engine sees.

* ``units``: the privacy unit (example or user) and the logical batches of units.
* ``user_ids``: reading and checking a data set's user ids.
* ``packing``: packed rows and their segments (one example per segment).
* ``length_grouping``: micro-batches grouped by length within a logical batch.
* ``micro_batches``: cutting a logical batch into micro-batches (the trainer's side).
* ``decoder_inputs``: decoder inputs of seq2seq models built row by row.
"""
