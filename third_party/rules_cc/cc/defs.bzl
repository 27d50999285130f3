"""Re-exports Bazel's native C++ rules.

Debian's bazel-bootstrap 4.2.3 asks for @rules_cc, and Debian's bazel-rules-cc is too new for
it; the native rules are all this project uses, so a tiny local repository is enough and keeps
the build offline.
"""

cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
