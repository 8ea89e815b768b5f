"""dropless.check: the combination matrix, where knobs meet.

Every knob is tested alone elsewhere; users find the failures where two meet. The matrix takes the
knobs as factors (factors.py: one line each), builds a pairwise covering array over them with the
config's validation as the constraint (covering.py: every pair of values meets in a row validation
accepts; the pairs validation refuses are checked to be refused with both fields named), and runs
each row through every command that takes a run (stages.py), in-process through each command's
`main(argv)` (runner.py judges what it did: worked and checked, refused before writing anything, or
failed). `python -m dropless.check.matrix` (matrix.py) is the command; CI runs it after the suite.

Package order: above bench, below cli (it calls the commands' modules, not the cli table).
"""
