"""The lab's modules, one file each; every file that defines `MODULE = LabModule(...)` is on the page."""
