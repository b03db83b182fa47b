from kvbridge.cli import run

run()
