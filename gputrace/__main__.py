from gputrace.cli import main

main(prog_name="gputrace")
