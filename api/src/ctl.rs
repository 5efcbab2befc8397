pub fn ctl_main(_args: Vec<String>) -> i32 { 0 }
