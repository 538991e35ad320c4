//! Builds strata's guest image from Debian packages: kernel, initramfs, ext4 root with the agent, cached by recipe hash.
