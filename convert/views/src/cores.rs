//! How many cores a job has: the count every decoding pool of stagefs sizes itself by (the
//! mount's view pool, `stagefs convert`'s workers, the Loader's default readers).
//!
//! A training job on a shared node is given some of its cores — SLURM binds it with an affinity
//! mask (`--cpus-per-task`), a container gets a cgroup CPU quota — and a pool sized by the
//! host's count (`sysconf(_SC_NPROCESSORS_ONLN)`, what `num_cpus::get` gives) starts 64 threads
//! on the 8 cores it may use: they only take turns, each with its own decode buffers. So the
//! count is `std::thread::available_parallelism`, which on Linux is the calling thread's
//! affinity mask (`sched_getaffinity`) further capped by the cgroup quota (cgroup v1 and v2),
//! and 1 when neither can be read. rayon's default pool size is the same call, so a pool built
//! without `num_threads` follows it too; [`job_cores`] names it so that every pool says which
//! count it uses, and the test below holds it to the affinity mask.

/// The cores this job may use: its affinity mask capped by its cgroup CPU quota (at least 1).
pub fn job_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::job_cores;

    /// The CPUs the calling thread may run on.
    fn allowed() -> Vec<usize> {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity writes at most
        // size_of::<cpu_set_t>() bytes into it (pid 0: the calling thread), and CPU_ISSET reads
        // indices below CPU_SETSIZE, inside the set.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            let size = std::mem::size_of::<libc::cpu_set_t>();
            let rc = libc::sched_getaffinity(0, size, &mut set);
            assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&cpu| libc::CPU_ISSET(cpu, &set))
                .collect()
        }
    }

    /// Restricts the calling thread to `cpus` (indices that came from [`allowed`]).
    fn restrict(cpus: &[usize]) {
        // SAFETY: as in `allowed`; CPU_SET is given indices below CPU_SETSIZE, and
        // sched_setaffinity reads size_of::<cpu_set_t>() bytes of the set.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &cpu in cpus {
                libc::CPU_SET(cpu, &mut set);
            }
            let size = std::mem::size_of::<libc::cpu_set_t>();
            let rc = libc::sched_setaffinity(0, size, &set);
            assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        }
    }

    #[test]
    fn a_restricted_affinity_mask_gives_fewer_cores_and_smaller_pools() {
        let all = allowed();
        assert!(
            job_cores() <= all.len(),
            "never more than the mask: {}",
            job_cores()
        );
        // On a thread of its own, so the test's other threads keep their mask.
        std::thread::spawn(move || {
            restrict(&all[..1]);
            assert_eq!(job_cores(), 1);
            // What `stagefs convert` builds without -j: rayon's default follows the mask.
            let pool = rayon::ThreadPoolBuilder::new()
                .build()
                .expect("a one-thread pool");
            assert_eq!(pool.current_num_threads(), 1);
            if all.len() >= 2 {
                restrict(&all[..2]);
                assert_eq!(job_cores(), 2);
            }
        })
        .join()
        .expect("the restricted thread");
    }
}
